"""Where the engine runs, one folder per host:

- in this process: in_process.py (LocalEngine and the registry of resources and sessions);
- in a worker process per resource: process/ (the process and its pipe, the local placement,
  RemoteEngine);
- on a trainer group of rank processes: ranks/;
- with generator replicas apart from the trainer: replicas/, or as vLLM servers: vllm/;
- placed on Ray: ray/.

Shared by them: messages.py (the one message vocabulary), placement.py (how processes start),
remote_streams.py (a decode stream across a process), lanes.py, staged_changes.py and
trainer_forwarding.py (what a host with generators apart shares: lanes.py's GeneratorLanes is
the one lanes implementation of replicas/ and vllm/), full_weight_sessions.py and threads.py
(the cores a process uses).
"""
