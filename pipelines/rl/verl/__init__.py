"""The verl engine: the PyVision method plugged into unmodified verl 0.9.1 (Ray, FSDP, vLLM).

Nothing here forks verl; each module fills one of verl's documented extension points:

- ``agent_loop``: the PyVision agent loop as a verl ``AgentLoopBase``, registered through the
  agent-loop config YAML the launcher writes into the run directory.
- ``reward``: the ``custom_reward_function`` entry (our verifiers, judge and tool reward).
- ``ranking``: the oversample-filter-rank strategy as the v1 trainer's custom sampler.
- ``overrides``: the recipe rendered as the complete Hydra override list of ``verl.trainer.main_ppo``.
- ``launch``: exports the data, writes the launch files and runs verl, streaming its metrics.

Only ``launch`` and ``overrides`` run in the pyvision process; the other modules are imported by
verl's Ray workers, in the interpreter of ``rl.verl.python``. Why each is built the way it is:
docs/verl-integration.md.
"""
