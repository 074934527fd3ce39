"""The project's experiments: studies, micro-benchmarks, the netns cluster, and the
results files their figures come from (``python -m experiments --help``)."""
