-- Which scorer decided each evaluated sample: 'judge', 'rules' (the benchmark's rules, no judge
-- asked), or 'rule_fallback' (the judge was asked and did not answer); NULL for samples stored
-- before this was recorded. With the task each sample was scored against, so stored predictions
-- can be scored again once the judge is back (`pyvision eval score --run-id`).
ALTER TABLE eval_trajectories ADD COLUMN scored_by VARCHAR;
ALTER TABLE eval_trajectories ADD COLUMN task JSON;
