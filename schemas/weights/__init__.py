"""The weight protocol: how a version of the policy goes from the learner to every engine, verified,
never half-applied, versions only increasing.

Learner side: `publish.Publisher` encodes each snapshot as an anchor or a delta onto the version it
published last (`payload`), writes it to the store (`store`) or inlines it, announces it on
`sao.weights` (`announcements`), and with the collective transport broadcasts it (`collective`).
Engine side: `follow.WeightSubscriber` reads the announcements back to the newest anchors, decides
with the pure `follow.Following` which chain to apply (`chain.plan`), rebuilds and verifies it
tensor by tensor and against the announced digest (`chain.rebuild`), and hands the state to the
engine in memory (`engine.Engine.load_state`). The services (learner, producers, evaluator,
export) import these modules; none of them imports a service.
"""
