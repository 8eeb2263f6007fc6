-- Which model file the policy ran on when an adapter or an update was made: JSON
-- {"file", "sha256", "file_type", "origin", "source_sha256"?} (NULL for rows written before
-- this migration or by a process that did not say).
ALTER TABLE adapters ADD COLUMN model TEXT CHECK (model IS NULL OR json_valid(model));
ALTER TABLE updates ADD COLUMN model TEXT CHECK (model IS NULL OR json_valid(model));
