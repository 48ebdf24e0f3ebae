-- Leadership among scheduler replicas on one database (see ARCHITECTURE.md, "High
-- availability"). Keep in step with the other database's file.
--
-- One row: the current leader's epoch (raised by one at every takeover), who holds it
-- (a replica's random id), where its gRPC API is (told to workers that reach a standby)
-- and when its lease runs out, by the database's clock. SQLite stays single-node and
-- never writes it.
CREATE TABLE leadership (
    id            BIGINT NOT NULL PRIMARY KEY CHECK (id = 1),
    epoch         BIGINT NOT NULL,
    holder        TEXT   NOT NULL,
    endpoint      TEXT   NOT NULL,
    expires_at_ms BIGINT NOT NULL
);
INSERT INTO leadership (id, epoch, holder, endpoint, expires_at_ms) VALUES (1, 0, '', '', 0);

-- The leader epoch an attempt was placed under (0: before leadership, or SQLite).
ALTER TABLE attempts ADD COLUMN leader_epoch BIGINT NOT NULL DEFAULT 0;
