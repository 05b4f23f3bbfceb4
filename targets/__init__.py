"""kiln.targets: the hardware targets as data (target.py) and what this machine has (detect.py), plus one Dockerfile
and deployment recipe per target. No model math and nothing that compiles. It imports kiln.models (errors, weight
formats) only — never kiln.compile or kiln.serving; `kiln targets` (targets_cmd.py) is its command.
"""
