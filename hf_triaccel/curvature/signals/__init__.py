"""Per-module second-order signals read from the collector's factors, for the precision
controller and the step-size steering: :class:`SignalTracker` (:mod:`.tracker`), the
factor maths it reads them with (:mod:`.terms`) and the gradient noise ratio
(:mod:`.noise`)."""

from hf_triaccel.curvature.signals.tracker import ModuleSignals, SignalTracker

__all__ = ["ModuleSignals", "SignalTracker"]
