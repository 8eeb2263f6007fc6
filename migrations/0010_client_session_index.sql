-- The client's session id of a live session (`metadata.client_session_id`), as an indexed
-- column: the server looks sessions up by it on every feedback, end and restore, and a scan of
-- every logged session's JSON under the handlers' database lock made each such request cost
-- O(sessions) (0.7 s with 200 000 sessions).
ALTER TABLE sessions ADD COLUMN client_session_id TEXT
    GENERATED ALWAYS AS (json_extract(metadata, '$.client_session_id')) VIRTUAL;
CREATE INDEX sessions_client ON sessions(client_session_id, id)
    WHERE client_session_id IS NOT NULL;
