-- Adapter activation history (for rollback) and the status of an update.
ALTER TABLE adapters ADD COLUMN activated_at TEXT;
-- the adapter that was active when this one was activated: where a rollback returns to
ALTER TABLE adapters ADD COLUMN previous_id INTEGER REFERENCES adapters(id);
ALTER TABLE updates ADD COLUMN status TEXT NOT NULL DEFAULT 'ok';
CREATE INDEX adapters_status ON adapters(status, activated_at);
