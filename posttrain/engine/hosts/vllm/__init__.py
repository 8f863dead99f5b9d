"""`--generators vllm`: vLLM servers as generator replicas (engine.py drives them; server.py
starts one; replica.py, stream.py, requests.py and scoring.py speak to it; worker_extension.py
runs inside it). Nothing here imports vLLM: it runs in its own venv."""
