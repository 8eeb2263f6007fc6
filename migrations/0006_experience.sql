-- The experience library (SLEA-RL's step-level retrieval): observation clusters, per cluster
-- strategy entries from the best successful sessions and warning entries from the worst
-- failures, and exactly which entries were injected into which logged turn.
CREATE TABLE experience_clusters (
    id         INTEGER PRIMARY KEY,
    prototype  BLOB    NOT NULL,   -- f32 little-endian: running mean of member embeddings
    members    INTEGER NOT NULL,
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE experience_entries (
    id          INTEGER PRIMARY KEY,
    cluster_id  INTEGER NOT NULL REFERENCES experience_clusters(id) ON DELETE CASCADE,
    kind        TEXT    NOT NULL CHECK (kind IN ('strategy', 'warning')),
    text        TEXT    NOT NULL,   -- the distilled step (the turn's text, order ids masked)
    context     TEXT    NOT NULL,   -- what the agent had just seen (masked, shortened)
    score       REAL    NOT NULL,
    source_turn INTEGER REFERENCES turns(id) ON DELETE SET NULL,
    update_id   INTEGER REFERENCES updates(id),
    created_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    updated_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    retired_at  TEXT               -- replaced by a higher-scoring entry (kept: injections cite it)
);
CREATE INDEX experience_entries_cluster ON experience_entries (cluster_id, kind, score);

CREATE TABLE experience_injections (
    turn_id  INTEGER NOT NULL REFERENCES turns(id) ON DELETE CASCADE,  -- the message carrying it
    entry_id INTEGER NOT NULL REFERENCES experience_entries(id),
    PRIMARY KEY (turn_id, entry_id)
);
