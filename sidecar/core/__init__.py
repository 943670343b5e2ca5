"""The engine core: requests, the scheduler, the dual-pool cache and sampling; no model code and no serving."""
