"""The collection runtime: the factors of each hooked layer (:mod:`.layer`), the hooks that
take their statistics (:mod:`.hooks`), the fold of one step's sums into the factors over
micro-batches and processes (:mod:`.averaging`, :mod:`.fold`, replayed as a CUDA graph
by :mod:`.graphs`) and the factor slices of parameters sharded by rows (:mod:`.sharding`).
:class:`~hf_triaccel.curvature.collector.FisherCollector` puts them together."""
