-- What the report's trajectory pages and `pyvision show` need beyond the trajectory JSON.
--
-- media: small thumbnails (WebP, content-addressed by the SHA-256 of their bytes, so an input
-- image shared by every model of every run is stored once) of the images a trajectory shows:
-- the task's input images and every image the interpreter returned.
CREATE TABLE media (
    sha256     VARCHAR PRIMARY KEY,
    mime       VARCHAR NOT NULL,
    width      INTEGER NOT NULL,
    height     INTEGER NOT NULL,
    data       BLOB NOT NULL,
    created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);

-- Per evaluated sample: {"inputs": [sha256 of each input image], "images": [sha256 of each image
-- of the trajectory, indexed like its turns' image_indices]}; NULL for samples stored before.
ALTER TABLE eval_trajectories ADD COLUMN media JSON;

-- A sample of each RL step's rollouts (local engine): every rollout's reward terms, advantage and
-- what the strategy did with its group; the whole trajectory only for the sampled groups.
CREATE TABLE rl_rollouts (
    run_id        VARCHAR NOT NULL,
    step          BIGINT NOT NULL,
    group_index   INTEGER NOT NULL,    -- generation order within the step
    sample_index  INTEGER NOT NULL,    -- rollout number within its group
    task_id       VARCHAR NOT NULL,
    data_source   VARCHAR,
    group_status  VARCHAR NOT NULL,    -- kept | zero_variance | empty | rank_cut
    rank          INTEGER,             -- position among the kept groups (0: highest reward std)
    status        VARCHAR NOT NULL,    -- kept, or why it was dropped: the group's status, or the
                                       -- rollout's own (broken:<reason>, no_image) in a kept group
    reward        DOUBLE,
    accuracy      DOUBLE,
    tool          DOUBLE,
    format        DOUBLE,
    advantage     DOUBLE,              -- against the whole group, before any filtering
    group_mean    DOUBLE,
    group_std     DOUBLE,
    stop_reason   VARCHAR,
    prediction    VARCHAR,
    turns         INTEGER,
    tool_calls    INTEGER,
    visual_tokens BIGINT,
    trajectory    JSON,                -- only for the groups sampled for display
    task          JSON,
    media         JSON,
    PRIMARY KEY (run_id, step, group_index, sample_index)
);
