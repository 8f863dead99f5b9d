"""An engine in worker processes of its own: the process and its pipe (worker.py), the
children it starts on this machine (local_placement.py), and the Engine that sends them
messages (remote.py)."""
