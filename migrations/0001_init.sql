-- Turnwise turn log, version 1.
-- A session is a conversation; a turn is one message; assistant turns carry the sampled tokens'
-- log-probs (tokens) and the hidden states they were sampled from (features).

CREATE TABLE sessions (
    id             INTEGER PRIMARY KEY,
    created_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    ended_at       TEXT,
    source         TEXT    NOT NULL CHECK (source IN ('live', 'chat', 'import', 'demo')),
    group_key      TEXT,
    outcome_reward REAL,
    reference      TEXT,            -- ground-truth final answer, when one exists
    content_hash   TEXT UNIQUE,     -- imports: hash of the conversation, to skip duplicates
    learned_at     TEXT,            -- last time an update used this session
    metadata       TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(metadata))
);

CREATE TABLE turns (
    id          INTEGER PRIMARY KEY,
    session_id  INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    idx         INTEGER NOT NULL,   -- position in the session, from 0
    role        TEXT    NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    text        TEXT    NOT NULL,
    token_ids   BLOB    NOT NULL,   -- little-endian i32 ids this turn appended to the context
    n_tokens    INTEGER NOT NULL,
    context_len INTEGER NOT NULL,   -- context length before this turn's tokens
    sampler     TEXT CHECK (sampler IS NULL OR json_valid(sampler)), -- settings that sampled it
    behavior    TEXT CHECK (behavior IS NULL OR behavior IN ('sampled', 'rescored')),
    stop_reason TEXT,
    adapter_id  INTEGER REFERENCES adapters(id),
    template    TEXT,               -- chat template that produced the tokens
    retokenized INTEGER NOT NULL DEFAULT 0,
    created_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    latency_ms  REAL,
    UNIQUE (session_id, idx)
);

-- Per-token log-probs of an assistant turn, as little-endian f32 arrays aligned with token_ids.
CREATE TABLE tokens (
    turn_id       INTEGER PRIMARY KEY REFERENCES turns(id) ON DELETE CASCADE,
    logp_behavior BLOB NOT NULL,    -- under the distribution sampled from (rescored: temperature 1)
    logp_full     BLOB NOT NULL     -- full softmax at temperature 1
);

-- Final hidden state of every position that sampled (or, rescored, predicted) a token, rounded
-- the way the CPU backend rounds it before the output matmul; q8_0 stores that rounding losslessly.
CREATE TABLE features (
    turn_id    INTEGER PRIMARY KEY REFERENCES turns(id) ON DELETE CASCADE,
    n_embd     INTEGER NOT NULL,
    dtype      TEXT    NOT NULL CHECK (dtype IN ('q8_0', 'f16', 'f32')),
    hidden     BLOB    NOT NULL,    -- n_tokens x n_embd, row-major
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE feedback (
    id         INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    turn_idx   INTEGER,
    kind       TEXT    NOT NULL,    -- thumb | outcome | note
    value      REAL,
    note       TEXT,
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE annotations (
    id         INTEGER PRIMARY KEY,
    turn_id    INTEGER NOT NULL REFERENCES turns(id) ON DELETE CASCADE,
    kind       TEXT    NOT NULL,
    value      REAL    NOT NULL,
    producer   TEXT    NOT NULL,
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE adapters (
    id         INTEGER PRIMARY KEY,
    parent_id  INTEGER REFERENCES adapters(id),
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    path       TEXT    NOT NULL,
    status     TEXT    NOT NULL DEFAULT 'candidate',
    metrics    TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(metrics))
);

CREATE INDEX turns_session ON turns(session_id, idx);
CREATE INDEX feedback_session ON feedback(session_id);
CREATE INDEX annotations_turn ON annotations(turn_id, kind);
