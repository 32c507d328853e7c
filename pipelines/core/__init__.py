"""The core vocabulary every stage shares: tasks, SFT conversations and their on-disk records.

``pipelines.core`` imports nothing else of ours but ``pipelines.errors``, ``pipelines.fsutil`` and
``pipelines.inputs``, so data, agent, RL, evaluation and the benchmarks all import it downward.
"""
