"""`posttrain demo`: a client of the API that shows RL improving the built-in model.

command.py (flags, progress bar) -> loop.py (warm-up then GRPO through the together SDK) ->
report.py (plot, summary, printout); task.py is the addition task, plot.py a PNG writer,
server.py starts `posttrain serve` in the background. Unlike the server packages, this one may
import `together`, always inside functions so that importing the CLI stays cheap.
"""
