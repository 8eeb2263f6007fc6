-- Sessions held out of learning (`metadata.held_out`, set by a request with `"learn": false`):
-- evaluation traffic that no update — the server's learner, `turnwise train`, a block SFT — may
-- train on. An indexed-free virtual column: the training selection filters on it.
ALTER TABLE sessions ADD COLUMN held_out INTEGER
    GENERATED ALWAYS AS (coalesce(json_extract(metadata, '$.held_out'), 0)) VIRTUAL;
