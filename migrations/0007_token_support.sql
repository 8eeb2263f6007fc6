-- Where each sampled token's behaviour distribution had its mass (JSON array aligned with the
-- turn's tokens; null for the whole tempered softmax): the kept set of top-k, a greedy digit or
-- an id slot, the masked tokens, or top-p's kept count. With the turn's sampler temperature it
-- lets the learner recompute the behaviour log-prob exactly. NULL: every token was sampled from
-- the whole softmax (rows written before this migration, rescored imports).
ALTER TABLE tokens ADD COLUMN support TEXT CHECK (support IS NULL OR json_valid(support));
