"""Beside vLLM or SGLang: their routers, read from what the engines return, without patching them.

* :mod:`~mla_watch.engines.geometry` - where the MoE layers are, from the model's ``config.json``;
* :mod:`~mla_watch.engines.formats` - the engines' routing fields: decode, count, strip (numpy);
* :mod:`~mla_watch.engines.decoder` - decoding in worker processes, off the event loop;
* :mod:`~mla_watch.engines.watch` - the routers' rolling windows and what was (not) counted;
* :mod:`~mla_watch.engines.recorder` - SGLang's expert distribution recorder, for all traffic.
"""
