"""RL: rewards, the PyVision rollout strategy, GRPO math, and the engines (local and verl).

The engine-agnostic parts (``rewards``, ``judge``, ``strategy``, ``algos``) are shared by the local
engine (``local``) and the verl integration (``verl``), so both train the same method.
"""
