"""``matformer relay``: a coordinator to the members near it, one member to the root
(docs/architecture.md, "Relays"; docs/scaling.md).

A relay joins the root as one member, hands the root's assignment out among its own members
by their speed, folds their results into one partial sum per parameter and tier region
(``modeling.compression.partial``) and submits that upstream; it serves the root's updates
and checkpoint files to its members from its cache, fetching each once.
"""
