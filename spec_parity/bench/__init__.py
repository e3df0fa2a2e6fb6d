"""`spec-parity bench`: how fast our drafters run, side by side with the peers, against the floor.

For each case (a draft source at a shape: the harness's Case with its `shapes`, bench/shapes.py)
and each side (a `Side`, bench/sides.py: our port, bench/port_sides.py; the peers,
bench/peers.py), on the same weights and inputs (bench/runner.py):

  (a) one draft step chain (assistant: `gamma` chained steps) / one draft block: median and
      p10-p90 wall time over `iters` runs after `warmup`, each run synchronized (`mx.eval` of
      its outputs; torch: `torch.cuda.synchronize()`), every side of the case timed in the same
      rounds, in rotation (bench/timing.py time_sides); CPU time too (a shared host shows there);
  (c) host synchronizations per step, COUNTED (`HostSyncs`, bench/counters.py);
  (e) peak memory over the side's warm-up runs (mx.get_peak_memory after mx.reset_peak_memory;
      torch: max_memory_allocated), and the active memory before them (the other sides' too);
  (f) graph ops per step: the primitives evaluated (`HostSyncs(ops=True)`).
For our port, through spec_parity.port.serve.generate (the loop itself, wrapped, never forked; bench/serve.py):
  (b) one spec round split into draft / verify / accept+trim;
  (c) host synchronizations and graph ops per round;
  (d) tokens/s on a fixed prompt.
The floor of a step = the bytes it must read (shapes.step_bytes) / the bandwidth measured in the
same run on the same device (a large copy, and a large sum). The launch cost (`launch_cost`),
measured in the same run too, is the other floor: what one kernel launch costs through MLX however
few bytes it reads (bench/timing.py). Figures are reported, never asserted: this is a benchmark,
not a test. bench.json, bench.md and bench.png: bench/report.py.

One code path for CPU and GPU: mx.default_device() decides. The package imports without torch,
transformers, optiq or dflash present: every peer is imported when its side is built.
"""

from .counters import HostBuffers, HostSyncs, count_step
from .runner import SIDES, Options, run

__all__ = ["SIDES", "HostBuffers", "HostSyncs", "Options", "count_step", "run"]
