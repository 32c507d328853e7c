-- Distilled SFT data (`pyvision data distill`): every teacher sample with its verdict, and the
-- data card of each distilled dataset (keyed by its folder), so acceptance can be queried.
CREATE TABLE distill_samples (
    dataset       VARCHAR NOT NULL,        -- the output folder (absolute path)
    task_id       VARCHAR NOT NULL,
    sample_index  INTEGER NOT NULL,
    family        VARCHAR,
    data_source   VARCHAR,
    verdict       VARCHAR NOT NULL,        -- accepted | the reason for rejection
    kept          BOOLEAN NOT NULL,        -- in the selected data
    selection     VARCHAR,                 -- kept | duplicate | over_max_per_task | balance (accepted only)
    turns         INTEGER,
    tool_calls    INTEGER,
    failed_calls  INTEGER,
    total_tokens  BIGINT,
    visual_tokens BIGINT,
    PRIMARY KEY (dataset, task_id, sample_index)
);

CREATE TABLE distill_cards (
    dataset    VARCHAR PRIMARY KEY,
    run_id     VARCHAR,
    teacher    VARCHAR,
    card       JSON,
    created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);
