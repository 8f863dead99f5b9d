"""The engine: what the service runs operations on, behind one protocol (interface.py).

The compute core (train/, generate/, optim/, parallel/, memory/, checkpoint/, state.py) is what
the engine computes, in this process, and knows nothing of processes; hosts/ is where it runs
(this process, worker processes, trainer groups, generator replicas, Ray); build.py is the one
module that picks among them.
"""
