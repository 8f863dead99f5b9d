"""Generator replicas apart from the trainer: the laned engine (engine.py), the replica
processes and their channel (channel.py), what crosses it (staged.py: typed staged changes),
the engine inside a replica (worker.py) and the weights broadcast to them
(weights_broadcast.py)."""
