"""Where the engine runs: in this process (in_process.py), in a worker process per resource
(worker_process.py, remote.py), in a trainer group of rank processes (trainer_group.py), with
generator replicas apart (replicas.py, replica_worker.py, replica_channel.py,
weights_broadcast.py) or as vLLM servers (vllm_engine.py, vllm_replica.py, vllm_server.py,
vllm_requests.py, vllm_scoring.py; vllm_worker_extension.py runs inside vLLM), placed locally
or on Ray (placement.py, local_placement.py, ray_placement.py); one message vocabulary between
them (messages.py).
"""
