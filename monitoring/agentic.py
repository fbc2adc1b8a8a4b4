"""The training dashboard's rows of agentic jobs: multi-turn episodes that the trainer
drives against an environment (`generation.multiTurn`, `rlhf_env_*`), and episodes of
agents that own their loop and call the rollout pool's gateway (`generation.agent`,
`rlhf_agent_*`). Each row's series exist only in jobs of its kind, so its panels are
empty for any other job, and the tests check each row on a run of its kind.
"""

from __future__ import annotations

from monitoring.charts import Chart, Row, chart, quantile, rate, step_gauges


def counted_and_cut(
    title: str, description: str, counted: tuple[str, str], cut: tuple[str, str]
) -> Chart:
    """Ops per second of two counters, each a (counter, legend) pair: what was done, and
    what was cut or refused, by its `reason` label. Both rows open with one."""
    (total, total_legend), (by_reason, reason_legend) = counted, cut
    return chart(
        title,
        description,
        (rate(total), f"{{{{rlhfjob}}}} {total_legend}"),
        (rate(by_reason, by="rlhfjob, reason"), f"{{{{rlhfjob}}}} {reason_legend}: {{{{reason}}}}"),
        unit="ops",
    )


MULTI_TURN = Row(
    "Multi-turn episodes",
    (
        counted_and_cut(
            "Episodes and cuts",
            "Episodes trained on per second, and those cut by a limit or an "
            "environment error (masked, not trained on), by reason.",
            ("rlhf_env_episodes_total", "episodes"),
            ("rlhf_env_cut_episodes_total", "cut"),
        ),
        chart(
            "Turns and tool calls",
            "Per episode, median and p95: assistant turns, and the tool calls parsed from them.",
            (quantile(0.5, "rlhf_env_turns"), "{{rlhfjob}} turns p50"),
            (quantile(0.95, "rlhf_env_turns"), "{{rlhfjob}} turns p95"),
            (quantile(0.5, "rlhf_env_tool_calls"), "{{rlhfjob}} tool calls p50"),
        ),
        chart(
            "Held-out episodes",
            "The held-out rows' episodes at the last evaluation: the share with "
            "at least one tool call, and the share cut by a limit or an error.",
            *step_gauges(
                ("rlhf_eval_tool_call_rate", "tool-call rate"),
                ("rlhf_eval_cut_ratio", "cut"),
            ),
        ),
        chart(
            "Environment calls",
            "Seconds of each step call to the environment (its tools, answered): "
            "median and p95. Slow tools hold every episode's next turn.",
            (quantile(0.5, "rlhf_env_step_seconds"), "{{rlhfjob}} p50"),
            (quantile(0.95, "rlhf_env_step_seconds"), "{{rlhfjob}} p95"),
            unit="s",
        ),
        chart(
            "Version span and restarts",
            "Policy versions between an episode's oldest and newest turn (p95: "
            "fully async's partial rollouts), and sessions per second started again "
            "on another replica because theirs died.",
            (quantile(0.95, "rlhf_env_version_span"), "{{rlhfjob}} version span p95"),
            (rate("rlhf_env_session_restarts_total"), "{{rlhfjob}} restarts"),
        ),
    ),
    multi_turn=True,
)


# Every panel is a rate: the counters are counted by the driver as each episode closes,
# after the step that ran it, so a rate over Grafana's window follows the run's pace.
AGENTS = Row(
    "Agent episodes",
    (
        chart(
            "Agent episodes by outcome",
            "Agent episodes closed per second, by how they ended: done (the agent "
            "answered with its reward), or cut and masked (not trained on): by a gateway "
            "limit (max_calls, max_call_tokens, episode_timeout), by the agent (agent_error, "
            "agent_timeout, agent_unreachable, agent_protocol) or with nothing to train "
            "(agent_no_calls, agent_unjudged).",
            (rate("rlhf_agent_episodes_total", by="rlhfjob, outcome"), "{{rlhfjob}} {{outcome}}"),
            unit="ops",
        ),
        counted_and_cut(
            "Gateway calls and refusals",
            "Chat completions per second the gateway served to the agents, and the calls "
            "it refused with OpenAI's error shape, by the limit they passed: each refusal "
            "cuts its episode.",
            ("rlhf_agent_calls_total", "calls"),
            ("rlhf_agent_refusals_total", "refused"),
        ),
        chart(
            "Calls per episode",
            "Chat completions served per agent episode closed, over the window: how many "
            "turns the agents take (generation.agent.maxCalls bounds it).",
            (
                f"{rate('rlhf_agent_calls_total')} / {rate('rlhf_agent_episodes_total')}",
                "{{rlhfjob}} calls per episode",
            ),
        ),
        chart(
            "Agent tokens",
            "Tokens per second of the agents' calls: the prompts the gateway rendered with "
            "the model's template, and what the engines sampled (the training data).",
            (rate("rlhf_agent_tokens_total", by="rlhfjob, kind"), "{{rlhfjob}} {{kind}}"),
        ),
        chart(
            "Samples left out",
            "Samples of agent episodes per second not trained on: an episode trains the "
            "sample holding its last call, and its earlier calls that extend nothing (an "
            "edited or summarised history, a reply cut at max_tokens) are left out.",
            (rate("rlhf_agent_samples_left_out_total"), "{{rlhfjob}} left out"),
            unit="ops",
        ),
    ),
    agent=True,
)
