"""Disaggregated prefill and decode: JetStream's three verbs on the paged engine
(``PrefillEngine.prefill``, ``DecodeEngine.insert`` / ``generate``), the ``Prefix`` that travels
between them, KV connectors that move it, and an orchestrator of bounded queues."""
