"""Fakes shared by the test suite and the benchmarks' CPU smoke runs.

Like ``accelerate.test_utils`` or ``transformers.testing_utils``: importable from the
installed package, never imported by the library itself. It imports only torch and the
package's own layers below ``integrations`` (``preemptible`` excepted, which is not
imported here).

- :mod:`hf_triaccel.testing.memory`: a device with a linear memory model that raises
  out-of-memory errors past its capacity, out-of-memory injection in a backward, a
  probe that counts releases, and a step rollback that records which samples each step
  kept.
- :mod:`hf_triaccel.testing.distributed`: a function run in several CPU processes joined
  by a gloo process group.
- :mod:`hf_triaccel.testing.preemptible`: a tiny Trainer job to stop by a signal and
  restart (imported by name: it imports transformers and the integrations).
"""

from hf_triaccel.testing.distributed import run_distributed
from hf_triaccel.testing.memory import (
    CountingProbe,
    FakeMemoryDevice,
    OOMInBackward,
    SampleLedger,
    oom,
)

__all__ = [
    "CountingProbe",
    "FakeMemoryDevice",
    "OOMInBackward",
    "SampleLedger",
    "oom",
    "run_distributed",
]
