"""Deployment artefacts generated from an engine spec (Kubernetes manifests, images)."""
