"""The direct launch of compiled Triton kernels and its fallback to the public launch.

On the CPU (Triton's interpreter) no kernel is compiled, so the direct launch itself runs
only on a GPU; what runs here is (1) the check that decides whether it may be used,
given launchers laid out as Triton's are and as a release might change them, and (2)
every caller forced onto the fallback: told that direct launches work, it gets no
compiled kernel it can launch directly and keeps launching through ``kernel[grid](...)``,
with the results of the reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_triaccel.kernels import grouped, launch, reductions, update
from hf_triaccel.kernels.launch import check_direct_launch, compiled_kernel
from tests.kernels.test_update import SMALL_SPECS, assert_matches, run_both

# float32 sums of the same terms in another order: a few ulps per term added
RTOL = 64 * torch.finfo(torch.float32).eps


class FakeCompiled:
    """A compiled probe kernel whose launcher ``run`` writes ``value`` into the vector of
    its public launch when given that vector's address, as a CUDA launcher would."""

    function, packed_metadata = "function", "packed"

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def launch_metadata(self, grid, stream, *args):
        return None

    def write(self, out_ptr, value) -> None:
        if out_ptr == self.out.data_ptr():
            self.out.fill_(value)


class Triton38Launcher(FakeCompiled):
    """The launcher's arguments as ``JITFunction.run`` passes them in Triton 3.3 to 3.8."""

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, exit_, *args):
        assert packed is self.packed_metadata
        self.write(args[0], args[1])


class WithoutPackedMetadata(FakeCompiled):
    """A launcher of a release that dropped the packed metadata from its arguments: it
    reads every later argument one place off."""

    def run(self, gx, gy, gz, stream, function, metadata, enter, exit_, *args):
        self.write(args[0], args[1])


class FakeProbe:
    """A probe kernel whose public launch fills the vector and returns ``compiled``."""

    def __init__(self, compiled: type | None) -> None:
        self.compiled = compiled

    def __getitem__(self, grid):
        def public(out, value, N):  # noqa: N803 (the kernel's constexpr name)
            out.fill_(value)
            return None if self.compiled is None else self.compiled(out)

        return public


@pytest.fixture
def fake_internals(monkeypatch):
    """launch_compiled's Triton internals as a CPU stands in for them: no launch hooks,
    stream 0 of device 0."""
    runtime = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    internals = (SimpleNamespace(runtime=runtime), lambda device: 0, lambda: 0)
    monkeypatch.setattr(launch, "_internals", lambda: internals)


def test_the_check_passes_launchers_laid_out_as_triton_lays_them_out(fake_internals):
    assert check_direct_launch(torch.device("cpu"), FakeProbe(Triton38Launcher)) == ""


def test_the_check_refuses_launchers_that_differ(fake_internals):
    cpu = torch.device("cpu")
    assert "wrote" in check_direct_launch(cpu, FakeProbe(WithoutPackedMetadata))

    class Raising(Triton38Launcher):
        def run(self, *args):
            raise TypeError("launch() takes 13 positional arguments")

    assert check_direct_launch(cpu, FakeProbe(Raising)).startswith("TypeError")
    assert "lacks" in check_direct_launch(cpu, FakeProbe(None))


def test_compiled_kernels_without_what_the_direct_launch_reads_are_refused():
    out = torch.zeros(1)
    assert compiled_kernel(Triton38Launcher(out)) is not None
    future = SimpleNamespace(result=lambda: Triton38Launcher(out))
    assert isinstance(compiled_kernel(future), Triton38Launcher)
    lacking = SimpleNamespace(run=None, function=None, launch_metadata=None)
    assert compiled_kernel(lacking) is None
    assert compiled_kernel(None) is None


def test_direct_launches_are_off_under_the_interpreter_and_off_cuda():
    assert not launch.direct_launch_supported(torch.device("cpu"))
    if launch._internals() is None:  # the CPU runs: TRITON_INTERPRET=1
        assert not launch.direct_launch_supported(torch.device("cuda"))


@pytest.fixture
def forced_fallback(monkeypatch):
    """Every caller told that direct launches work, with compiled kernels that lack an
    attribute the direct launch reads (a later release's; under the interpreter there is
    no compiled kernel at all), and failing the test if it launches directly: each caller
    must keep to the public launch."""

    def direct(*args):
        raise AssertionError("launched directly without a compiled kernel")

    attributes = (*launch.COMPILED_ATTRIBUTES, "an_attribute_of_a_later_release")
    monkeypatch.setattr(launch, "COMPILED_ATTRIBUTES", attributes)
    for module in (reductions, grouped, update):
        monkeypatch.setattr(module, "direct_launch_supported", lambda device: True)
        monkeypatch.setattr(module, "launch_compiled", direct)
    grouped.forget_plans()
    update.clear_cache()
    yield
    grouped.forget_plans()
    update.clear_cache()


def test_a_reduction_falls_back_to_the_public_launch(forced_fallback, device):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(300, 40, generator=g).to(device)
    kept = reductions.reduction_launch(x, square=True)
    assert kept.template is not None  # set up for direct launches
    out, want = torch.zeros(40, device=device), torch.zeros(40, device=device)
    for accumulate in (False, False, True, True):
        kept(x, out, 0.5, accumulate)
        sums = (x * x).sum(0) * 0.5
        want = want + sums if accumulate else sums
        torch.testing.assert_close(out, want, rtol=RTOL, atol=0.0)
    assert set(kept.compiled.values()) == {None}  # nothing to launch directly


def test_grouped_launches_fall_back_to_the_public_launch(forced_fallback, device):
    g = torch.Generator().manual_seed(1)
    entries = []
    for n in (300, 41):
        x = torch.rand(n, 64, generator=g).to(device)
        out = torch.zeros(64, device=device)
        entries.append((reductions.reduction_launch(x, True), x, out, 0.25, False))
    key = grouped.group_key(entries[0][0], entries[0][1])
    assert all(grouped.group_key(e[0], e[1]) == key for e in entries)
    sums = torch.rand(3, 40, generator=g).to(device)
    taps = (torch.rand(40, 9, generator=g) > 0.5).float().to(device)
    gathered = torch.zeros(3, 9, device=device)
    for _ in range(2):  # the second call launches the kept plans again
        grouped.launch_grouped(key, entries)
        grouped.launch_gathers(grouped.gather_key(taps), [(sums, taps, gathered)])
        for _, x, out, scale, _ in entries:
            torch.testing.assert_close(out, (x * x).sum(0) * scale, rtol=RTOL, atol=0.0)
        torch.testing.assert_close(gathered, sums @ taps, rtol=RTOL, atol=0.0)


def test_the_update_falls_back_to_the_public_launch(forced_fallback, device):
    run = run_both(
        SMALL_SPECS,
        dtype=torch.float32,
        n_steps=3,
        lr=0.01,
        weight_decay=0.1,
        decoupled=True,
        device=device,
    )
    assert_matches(run.params, run.ref_params, torch.float32)
    assert_matches(run.moms, run.ref_moms, torch.float32)
