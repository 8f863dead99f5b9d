"""Operations: submitted (submit.py, payloads.py), their kinds (kinds.py), arrivals waited on
(arrivals.py), status changes recorded (recording.py) and polls held until done (polls.py,
completion.py)."""
