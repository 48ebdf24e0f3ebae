-- Command memory models are kept per tenant: one tenant's runs of a command never size
-- another tenant's runs of the same command (same argv, env and working directory).
--
-- Existing rows are dropped, not carried: they were keyed by the command alone, so any
-- of them may hold what another tenant's runs taught it, and before this change a
-- profile on a simulated GPU stored "0 B + 0 B per sample" models that sized slices at
-- 0 bytes. Nothing is lost that matters: the next `vram = "auto"` job of each command
-- profiles again, and declared jobs run as declared meanwhile.
--
-- model_json is core's LearnedModel ({"model": CommandMemoryModel, "measured": bool}:
-- measured is false for the fallback an unmeasured profile left); basis says for people
-- what the model rests on (which job's profile or attempt measured it, or why it is a
-- fallback).
DROP TABLE command_memory_models;

CREATE TABLE command_memory_models (
    tenant        TEXT    NOT NULL,
    shape_key     TEXT    NOT NULL,
    model_json    TEXT    NOT NULL,
    basis         TEXT    NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, shape_key)
);
