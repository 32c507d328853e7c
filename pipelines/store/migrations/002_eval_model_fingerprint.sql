-- Which weights produced each evaluated sample: a resumed evaluation reuses only the samples the
-- same weights produced (a model folder retrained in place gets evaluated again).
ALTER TABLE eval_trajectories ADD COLUMN model_fingerprint VARCHAR;
