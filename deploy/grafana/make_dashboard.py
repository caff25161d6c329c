#!/usr/bin/env python3
"""Writes moeline-stack.json, the Grafana dashboard of a moeline stack, from the panel list below
(dashboards as code: edit here, run, commit both). Every query reads metrics the stages export;
tests/deploy/test_dashboard.py checks that the JSON is what this script writes and the stack_metrics
test that each metric it names is on a real stack's /metrics.

  deploy/grafana/make_dashboard.py [--out deploy/grafana/moeline-stack.json]
"""

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

# (row title, [(panel title, unit, [(PromQL, legend)])]).
ROWS = [
    ("Traffic", [
        ("Requests by outcome", "reqps", [
            ('sum by (outcome) (rate(moeline_gateway_requests_total[$__rate_interval]))',
             "{{outcome}}")]),
        ("Requests in flight", "short", [
            ("sum(moeline_gateway_in_flight_requests)", "in flight")]),
        ("Requests per tenant", "reqps", [
            ('sum by (tenant, result) (rate(moeline_gateway_tenant_requests_total'
             '[$__rate_interval]))', "{{tenant}} {{result}}")]),
        ("Refused (by reason)", "reqps", [
            ('sum by (reason) (rate(moeline_gateway_rejected_total[$__rate_interval]))',
             "gateway {{reason}}"),
            ('sum by (reason) (rate(moeline_wire_rejected_frames_total[$__rate_interval]))',
             "wire {{reason}}")]),
    ]),
    ("Latency", [
        ("Time to first token", "s", [
            (f'histogram_quantile({q}, sum by (le) (rate(moeline_gateway_ttft_seconds_bucket'
             f'[$__rate_interval])))', f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)]),
        ("Inter-token latency", "s", [
            (f'histogram_quantile({q}, sum by (le) (rate('
             f'moeline_gateway_time_per_output_token_seconds_bucket[$__rate_interval])))',
             f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)]),
        ("Queue time before prefill", "s", [
            (f'histogram_quantile({q}, sum by (le) (rate(moeline_gateway_queue_seconds_bucket'
             f'[$__rate_interval])))', f"p{int(q * 100)}") for q in (0.5, 0.95)]),
        ("Decode step", "s", [
            ('histogram_quantile(0.95, sum by (le, stage) (rate(moeline_decode_step_seconds_bucket'
             '[$__rate_interval])))', "{{stage}} p95")]),
    ]),
    ("Stages", [
        ("Queue depths", "short", [
            ("sum by (queue) (moeline_gateway_queue_depth)", "gateway → {{queue}}"),
            ("sum by (stage) (moeline_prefill_queue_depth)", "{{stage}}"),
            ("sum by (stage) (moeline_decode_queue_depth)", "{{stage}}"),
            ("sum by (stage) (moeline_probe_queue_depth)", "{{stage}}")]),
        ("Decode batch occupancy", "short", [
            ("sum by (stage) (moeline_decode_active_sequences)", "{{stage}} sequences"),
            ('histogram_quantile(0.5, sum by (le, stage) (rate(moeline_decode_batch_size_bucket'
             '[$__rate_interval])))', "{{stage}} batch p50")]),
        ("KV blocks in use", "percentunit", [
            (f'sum by (stage) (moeline_{s}_kv_blocks{{state="used"}}) / sum by (stage) '
             f'(moeline_{s}_kv_blocks)', "{{stage}}") for s in ("prefill", "decode")]),
        ("Stages up and restarts", "short", [
            ('up{job="moeline"}', "{{stage}} up"),
            ("changes(moeline_process_start_time_seconds[1h])", "{{stage}} restarts (1 h)"),
            ('sum by (stage) (rate(moeline_handler_errors_total[$__rate_interval]))',
             "{{stage}} handler errors/s")]),
    ]),
    ("Reuse", [
        ("Reuse hit rate by level", "percentunit", [
            ('sum by (level) (rate(moeline_probe_hits_total{level!="none"}[$__rate_interval])) '
             '/ ignoring (level) group_left sum(rate(moeline_probe_lookups_total'
             '[$__rate_interval]))', "{{level}}")]),
        ("Prompt tokens reused", "percentunit", [
            ('sum(rate(moeline_prefill_reused_tokens_total[$__rate_interval])) / '
             'sum(rate(moeline_prefill_tokens_total[$__rate_interval]))', "reused share")]),
        ("Approximate reuse state", "short", [
            ("max(moeline_gateway_approximate_enabled)", "enabled"),
            ("max(moeline_gateway_shadow_agreement)", "shadow agreement"),
            ('sum by (reason) (increase(moeline_gateway_approximate_transitions_total'
             '[$__rate_interval]))', "switched: {{reason}}")]),
        ("Approximate requests by outcome", "reqps", [
            ('sum by (outcome) (rate(moeline_gateway_approximate_requests_total'
             '[$__rate_interval]))', "{{outcome}}")]),
        ("Snapshot store: bytes held and files on disk", "bytes", [
            ("sum by (tier) (moeline_probe_store_bytes)", "held: {{tier}}"),
            ("sum by (store) (moeline_probe_store_disk_file_bytes)", "on disk: {{store}}")]),
    ]),
    ("Experts", [
        ("Expert pool hit ratio", "percentunit", [
            ("max by (tier) (moeline_offload_expert_hit_ratio)", "{{tier}}")]),
        ("Hit ratio per layer", "percentunit", [
            ("max by (layer) (moeline_offload_layer_hit_ratio)", "layer {{layer}}")]),
        ("Expert load time", "s", [
            (f'histogram_quantile({q}, sum by (le) (rate('
             f'moeline_offload_expert_load_seconds_bucket[$__rate_interval])))',
             f"p{int(q * 100)}") for q in (0.5, 0.95)]),
        ("Stall per token and bytes moved", "short", [
            ("max(moeline_offload_stall_seconds_per_token)", "stall s/token"),
            ('sum by (from) (rate(moeline_offload_bytes_moved_total[$__rate_interval]))',
             "bytes/s from {{from}}")]),
        ("Router load imbalance per layer", "short", [
            ("max by (layer) (moeline_offload_load_imbalance)", "layer {{layer}}")]),
        ("Router confidence per layer", "short", [
            ("max by (layer) (moeline_offload_router_confidence)", "layer {{layer}}")]),
        ("Router health per layer (0 ok, 1 warning, 2 critical)", "short", [
            ("max by (layer) (moeline_offload_router_health)", "layer {{layer}}")]),
        ("Prefetch precision and recall", "percentunit", [
            ("max(moeline_offload_prefetch_precision)", "precision"),
            ("max(moeline_offload_prefetch_recall)", "recall")]),
        ("Prefetch on, by kind of pass (0: switched off: it came late or went unused)", "short", [
            ("min by (kind) (moeline_offload_prefetch_enabled)", "{{kind}}")]),
    ]),
]


def dashboard():
    panels, panel_id, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": panel_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, (title, unit, queries) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": title, "id": panel_id,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi"}},
                "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + k)}
                            for k, (expr, legend) in enumerate(queries)],
            })
            panel_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "title": "moeline stack", "uid": "moeline-stack", "schemaVersion": 39, "version": 1,
        "editable": True, "tags": ["moeline"], "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [{"type": "datasource", "name": "datasource", "label": "Prometheus",
                                 "query": "prometheus"}]},
        "panels": panels,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "moeline-stack.json"))
    args = ap.parse_args()
    with open(args.out, "w") as f:
        json.dump(dashboard(), f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
