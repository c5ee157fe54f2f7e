"""Reference prompts: fixed prompts per business line, read on a schedule and on demand, whose readings tell what
changed when routing changed - the model, or what clients send (the cause of each routing alert).

* :mod:`~mla_watch.references.prompts`: reference prompts per business line, fixed and versioned (YAML), and the long
  sets that reach far positions;
* :mod:`~mla_watch.references.budget`: how much of a set one reading reads (a prompt's limit, the set's token budget);
* :mod:`~mla_watch.references.readers`: how they are read, through the model served here or the engine beside;
* :mod:`~mla_watch.references.reach`: which positions an alert concerns, and whether a reading reached them;
* :mod:`~mla_watch.references.readings`: a reading, its healthy baseline, how the two compare (no torch);
* :mod:`~mla_watch.references.prober`: readings on a schedule and on demand, and the cause of each routing alert.

Who sent the traffic, and each line's token shares per client, is counted with the routing
(:mod:`mla_watch.routing.clients`).
"""
