"""Evidence of a model's quality (no torch but :mod:`~mla_watch.quality.local_model`): a model state scored on a set
of texts, the band its routers must hold, and the paired perplexity test; what the re-tune gates and the reference
readings both judge with."""
