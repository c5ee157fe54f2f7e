"""The fleet's tables in PostgreSQL, created by the first sidecar that connects (under an advisory lock, one sidecar at
a time)."""

from __future__ import annotations

__all__ = [
    "SCHEMA",
    "SCHEMA_LOCK",
]

SCHEMA_LOCK = 0x6D6C6177  # pg_advisory_xact_lock key: one sidecar at a time makes the tables
SCHEMA = """
CREATE TABLE IF NOT EXISTS mla_watch_fleet_bases (
    base text PRIMARY KEY,
    current integer NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS mla_watch_fleet_members (
    name text PRIMARY KEY,
    base text NOT NULL,
    digest text NOT NULL,
    version integer,
    url text,
    started_at timestamptz NOT NULL DEFAULT now(),
    last_seen timestamptz NOT NULL DEFAULT now(),
    health jsonb NOT NULL DEFAULT '{}'::jsonb);
CREATE TABLE IF NOT EXISTS mla_watch_fleet_versions (
    base text NOT NULL,
    number integer NOT NULL,
    digest text NOT NULL,
    parent integer,
    job text,
    created_by text,
    created_at timestamptz NOT NULL DEFAULT now(),
    bytes bigint NOT NULL DEFAULT 0,
    bad boolean NOT NULL DEFAULT false,
    manifest jsonb NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (base, number),
    UNIQUE (base, digest));
CREATE TABLE IF NOT EXISTS mla_watch_fleet_tensors (
    base text NOT NULL,
    number integer NOT NULL,
    router text NOT NULL,
    data bytea NOT NULL,
    PRIMARY KEY (base, number, router));
CREATE TABLE IF NOT EXISTS mla_watch_fleet_lease (
    id integer PRIMARY KEY CHECK (id = 1),
    holder text,
    job text,
    taken_at timestamptz,
    expires_at timestamptz);
INSERT INTO mla_watch_fleet_lease (id) VALUES (1) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS mla_watch_fleet_jobs (
    id text PRIMARY KEY,
    base text NOT NULL,
    routers text[] NOT NULL,
    business_line text,
    canary text NOT NULL,
    state text NOT NULL,
    tried boolean NOT NULL DEFAULT false,
    version integer,
    started_at timestamptz NOT NULL DEFAULT now(),
    ended_at timestamptz,
    detail jsonb NOT NULL DEFAULT '{}'::jsonb);
CREATE TABLE IF NOT EXISTS mla_watch_fleet_rollouts (
    id serial PRIMARY KEY,
    base text NOT NULL,
    version integer NOT NULL,
    digest text NOT NULL,
    previous integer NOT NULL,
    job text,
    state text NOT NULL,
    batch integer NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    ended_at timestamptz,
    halted_by text,
    reason text);
CREATE TABLE IF NOT EXISTS mla_watch_fleet_steps (
    rollout integer NOT NULL REFERENCES mla_watch_fleet_rollouts (id),
    member text NOT NULL,
    outcome text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    ended_at timestamptz,
    detail jsonb NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (rollout, member));
"""
