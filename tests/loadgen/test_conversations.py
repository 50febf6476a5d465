import random

from loadgen.conversations import tenant_conversations


def test_turns_extend_each_other_and_templates_repeat_across_tenants():
    seed = random.randrange(2**31)
    convs = tenant_conversations(9, 40, 3, (3, 7), 4, 500, seed, shared_every=4)
    assert len({c.tenant for c in convs}) == 9
    assert convs[4].system == convs[8].system == convs[0].system and convs[1].system != convs[0].system
    c = convs[1]
    first = c.prompt(0)
    assert first[:40] == c.system and len(first) == 40 + len(c.user_turns[0])
    c.replies.append([11, 12, 13, 14])
    second = c.prompt(1)
    assert second[:len(first)] == first and second[len(first):len(first) + 4] == [11, 12, 13, 14]
    assert second[len(first) + 4:] == c.user_turns[1]
