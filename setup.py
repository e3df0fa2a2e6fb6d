"""The package layout pyproject.toml cannot say: the repository keeps port/, oracles/ and fixtures/
at its top, the distribution installs them as spec_parity.port, spec_parity.oracles and
spec_parity/fixtures (the goldens), so it claims no import name but spec_parity. A list computed
here, not written out: a new subpackage ships without an edit."""

from setuptools import find_namespace_packages, find_packages, setup

MAPPED = {"spec_parity.port": "port", "spec_parity.oracles": "oracles"}
DATA = {"spec_parity.fixtures": "fixtures"}

packages = find_packages(include=["spec_parity", "spec_parity.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
packages += [f"{name}.{sub}" if sub else name for name, folder in DATA.items()
             for sub in ["", *find_namespace_packages(folder)]]

setup(packages=packages, package_dir={**MAPPED, **DATA},
      package_data={name: ["*.json", "*.safetensors", "*.md"] for name in packages if name.startswith(*DATA)})
