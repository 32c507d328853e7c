-- Runs, their stages, per-step metrics, evaluation results, and the LLM-judge cache.
CREATE TABLE runs (
    run_id      VARCHAR PRIMARY KEY,
    name        VARCHAR NOT NULL,
    recipe_path VARCHAR,
    config_json JSON,
    git_sha     VARCHAR,
    created_at  TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE stages (
    run_id      VARCHAR NOT NULL,
    stage       VARCHAR NOT NULL,
    status      VARCHAR NOT NULL,          -- running | done | failed
    run_dir     VARCHAR,
    started_at  TIMESTAMP,
    finished_at TIMESTAMP,
    summary     JSON,
    PRIMARY KEY (run_id, stage)
);

CREATE TABLE metrics (
    run_id  VARCHAR NOT NULL,
    stage   VARCHAR NOT NULL,
    step    BIGINT NOT NULL,
    name    VARCHAR NOT NULL,
    value   DOUBLE,
    time    TIMESTAMP NOT NULL DEFAULT current_timestamp
);
CREATE INDEX metrics_run_stage ON metrics (run_id, stage, name);

CREATE TABLE eval_trajectories (
    run_id            VARCHAR NOT NULL,
    model             VARCHAR NOT NULL,    -- base | sft | rl | a path or URL
    benchmark         VARCHAR NOT NULL,
    sample_id         VARCHAR NOT NULL,
    benchmark_version VARCHAR NOT NULL,
    prompt_version    VARCHAR NOT NULL,
    prompt_hash       VARCHAR NOT NULL,
    scorer            VARCHAR NOT NULL,
    prediction        VARCHAR,
    stop_reason       VARCHAR,
    turns             INTEGER,
    tool_calls        INTEGER,
    failed_calls      INTEGER,
    visual_tokens     BIGINT,
    total_tokens      BIGINT,
    duration_s        DOUBLE,
    trajectory        JSON,
    created_at        TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, model, benchmark, sample_id)
);

CREATE TABLE eval_scores (
    run_id     VARCHAR NOT NULL,
    model      VARCHAR NOT NULL,
    benchmark  VARCHAR NOT NULL,
    sample_id  VARCHAR NOT NULL,
    metric     VARCHAR NOT NULL,
    value      DOUBLE,
    PRIMARY KEY (run_id, model, benchmark, sample_id, metric)
);

CREATE TABLE eval_aggregates (
    run_id            VARCHAR NOT NULL,
    model             VARCHAR NOT NULL,
    benchmark         VARCHAR NOT NULL,
    metric            VARCHAR NOT NULL,
    value             DOUBLE,
    n                 INTEGER,
    benchmark_version VARCHAR,
    prompt_version    VARCHAR,
    scorer            VARCHAR,
    created_at        TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (run_id, model, benchmark, metric)
);

CREATE TABLE judge_cache (
    key        VARCHAR PRIMARY KEY,        -- sha256 of (model, prompt)
    model      VARCHAR NOT NULL,
    response   VARCHAR NOT NULL,
    verdict    DOUBLE,
    created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);
