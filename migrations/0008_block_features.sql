-- Block inputs for block LoRA: the input of the first adapted block (llama.cpp's `l_out-N`) at
-- every position a reply's generation covered, so the last blocks can be recomputed over the
-- whole session. Keyed by the assistant turn whose generation produced them; positions
-- first_pos .. first_pos + n_pos of the session's token sequence.
CREATE TABLE block_features (
    turn_id    INTEGER PRIMARY KEY REFERENCES turns(id) ON DELETE CASCADE,
    layer      INTEGER NOT NULL,    -- N of l_out-N
    n_embd     INTEGER NOT NULL,
    dtype      TEXT    NOT NULL CHECK (dtype IN ('f16', 'f32')),
    first_pos  INTEGER NOT NULL,
    n_pos      INTEGER NOT NULL,
    activations BLOB   NOT NULL,    -- n_pos x n_embd, row-major
    created_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
