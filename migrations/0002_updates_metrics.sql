-- Learning runs and free-form metrics (written by the learner and the server).
CREATE TABLE updates (
    id          INTEGER PRIMARY KEY,
    created_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    adapter_id  INTEGER REFERENCES adapters(id),
    algo        TEXT NOT NULL,
    config      TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(config)),
    diagnostics TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(diagnostics))
);

CREATE TABLE metrics (
    id         INTEGER PRIMARY KEY,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    name       TEXT NOT NULL,
    value      REAL NOT NULL,
    labels     TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(labels))
);

CREATE INDEX sessions_source ON sessions(source, created_at);
