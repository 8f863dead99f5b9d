"""Model resources and training sessions: created, checked, updated, expired, stopped
(resources.py, sessions.py, policy.py, expiry.py)."""
