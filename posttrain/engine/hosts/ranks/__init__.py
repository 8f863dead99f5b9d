"""A resource's trainer split over a group of rank processes (trainer_group.py)."""
