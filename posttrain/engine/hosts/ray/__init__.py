"""`posttrain serve --ray`: a resource's processes as Ray actors (placement.py)."""
