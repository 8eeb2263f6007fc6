-- Group keys for live traffic: leader clusters of opening states (the policy's own hidden state
-- after the first user message), kept across updates so that keys stay stable.
CREATE TABLE opening_clusters (
    id         INTEGER PRIMARY KEY,
    n_embd     INTEGER NOT NULL,
    prototype  BLOB    NOT NULL,   -- f32 little-endian, running mean of its members
    members    INTEGER NOT NULL,
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
