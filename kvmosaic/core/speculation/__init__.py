"""Speculative decoding at the scheduler's level: proposers guess the next tokens (n-gram lookup, or
what the worker's draft model drafted), the ``Speculator`` picks each sequence's k from measured
costs, and the target verifies the guesses in one pass. The draft model itself runs in the worker
(``kvmosaic.worker.drafter``); its config is ``kvmosaic.config_spec``."""
