"""Running operations on the engine: the scheduler and its per-resource workers (scheduler.py,
worker.py), memory admission (admission.py), sample passes as streams (sample_streams.py) and
deferred weights-sync (publishing.py)."""
