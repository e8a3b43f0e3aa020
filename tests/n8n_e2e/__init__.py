"""End-to-end check of examples/n8n in a real n8n 2.8.4 (`make n8n-e2e`, `python -m tests.n8n_e2e`).

Starts the gateway, a fake CRM, a scripted chat model and n8n with every example workflow
imported and published, drives each workflow through its production webhook URL, and counts
the CRM's tasks per business event. Kept out of `make test`: n8n is a 2.3 GB install.
"""
