"""Sampling: what each generator serves, prefill, the decode loop and its rows, static-shape
decode passes, sampling math and the prefix cache of prompt KV.
"""
