"""Each tox env holds the references it promises (a missing one skips with what to run)."""

import importlib.util

import pytest


@pytest.mark.oracle
@pytest.mark.tf515
def test_tf515_env_runs_zlab_dflash_torch_reference():
    import transformers

    if not transformers.__version__.startswith("5.15."):
        pytest.skip(f"z-lab dflash's torch model needs transformers 5.15 (here {transformers.__version__}): "
                    "run `tox -e oracle-tf515`")
    if importlib.util.find_spec("dflash") is None:
        pytest.skip("pip install --no-deps dflash==0.1.0")
    from dflash import model

    assert hasattr(model, "DFlashDraftModel") or any("DFlash" in n for n in dir(model))


@pytest.mark.oracle
def test_optiq_spec_runtime_imports_where_installed():
    if importlib.util.find_spec("optiq") is None:
        pytest.skip("pip install --no-deps mlx-optiq==0.7.7")
    from optiq.runtime.spec.drafters import gemma_assistant

    assert hasattr(gemma_assistant, "GemmaAssistantDrafter")
