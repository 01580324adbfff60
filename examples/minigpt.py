"""The JAX AI stack's tutorial "Train a miniGPT language model with JAX" on mirrorax, in the docs' loop: a port.

The program of ``minigpt_original.py`` (the tutorial as JAX runs it) with the lines a port changes: the
strategy made from the tutorial's mesh (``MirroredStrategy(mesh=mesh)``), ``@strategy.jit`` on its train step,
its loader read through ``strategy.experimental_distribute_dataset`` and its ``jax.device_put`` of each batch
dropped (the strategy splits the batches). The loop builds its step's input from each batch as the tutorial
does (``jnp.array(jnp.array(batch).T)``, targets by ``jax.vmap``): the arrays stay split over the devices, and
where the batch holds padding (32 rows on 3 devices are placed as 33) the step is given its real rows. Its two
generation methods keep ``@nnx.jit`` (one prompt's inference, nothing to split; ``@strategy.jit`` runs them as
well: ``minigpt_sharded.py``). ``tests/test_nnx.py`` counts the changed lines (5 beyond the import and the
strategy line) and checks 1, 3, 4 and 8 devices against the original on one, within the original's floor.

Run: ``JAX_NUM_CPU_DEVICES=8 python examples/minigpt.py``.
"""
# fmt: off
# ruff: noqa: E111, E114, E501, F841, I001, B007, UP015, UP034

import numpy as np

import mirrorax as mx

WORDS = ['once', 'upon', 'a', 'time', 'there', 'was', 'little', 'big', 'red', 'blue', 'cat', 'dog', 'bird', 'girl',
         'boy', 'who', 'liked', 'to', 'play', 'run', 'jump', 'sing', 'in', 'the', 'park', 'garden', 'sun', 'one',
         'day', 'she', 'he', 'saw', 'friend', 'and', 'they', 'were', 'happy', 'sad', 'tree', 'ball', 'found', 'lost',
         'home', 'went', 'with', 'mom', 'dad', 'said', 'hello', 'good', 'night', 'fun', 'was', '.', ',']


class Tokenizer:
  """A word tokenizer with the interface the tutorial uses of tiktoken's GPT-2 encoding."""

  def __init__(self, n_vocab=64):
    self.words = list(dict.fromkeys(WORDS))
    self.n_vocab = n_vocab
    self.ids = {w: i + 1 for i, w in enumerate(self.words)}  # 0: the tutorial's padding id

  def encode(self, text, allowed_special=()):
    return [self.n_vocab - 1 if w == '<|endoftext|>' else self.ids[w] for w in text.replace('<|endoftext|>', ' <|endoftext|> ').split()]

  def decode(self, tokens):
    return ' '.join('<|endoftext|>' if t == self.n_vocab - 1 else self.words[t - 1] if 0 < t <= len(self.words) else '?' for t in tokens)


def stories(num_stories, seed=0):
  """TinyStories-like text: short stories from a small grammar, each ended by <|endoftext|>."""
  rng = np.random.default_rng(seed)

  def pick(*ws):
    return ws[rng.integers(len(ws))]

  out = []
  for _ in range(num_stories):
    who, what = pick('cat', 'dog', 'bird', 'girl', 'boy'), pick('play', 'run', 'jump', 'sing')
    story = f"once upon a time there was a {pick('little', 'big', 'red', 'blue')} {who} who liked to {what} in the {pick('park', 'garden', 'sun')} ."
    story += f" one day {pick('she', 'he')} saw a {pick('friend', 'tree', 'ball')} and they were {pick('happy', 'sad')} ."
    out.append(story + ' <|endoftext|>')
  return '\n'.join(out)


def nudge(model, ulps):
  """Moves every weight of ``model`` by one unit in the last place, up (``ulps=1``) or down (``-1``); 0: unchanged."""
  from flax import nnx
  import jax
  if ulps:
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda a: np.nextafter(np.asarray(a), np.float32(np.inf * ulps)).astype(a.dtype), state))


def main(devices=None, mesh_shape=(1, 1), num_stories=200, batch_size=32, log_every=2, max_steps=6, ulps=0):
  import os
  import tempfile

  import jax
  import jax.numpy as jnp

  from jax.sharding import Mesh, PartitionSpec as P, NamedSharding # For data and model parallelism (explained in more detail later)
  from jax.experimental import mesh_utils

  import flax.nnx as nnx
  import optax

  from dataclasses import dataclass
  import grain.python as pygrain
  import pandas as pd
  import time

  file_path = os.path.join(tempfile.mkdtemp(), 'TinyStories-train.txt')
  with open(file_path, 'w') as f:
    f.write(stories(num_stories))
  devices = jax.devices()[:1] if devices is None else devices

  # Create a `Mesh` object representing TPU device arrangement.
  mesh = Mesh(mesh_utils.create_device_mesh(mesh_shape, devices), ('batch', 'model'))
  strategy = mx.MirroredStrategy(mesh=mesh)

  tokenizer = Tokenizer()

  # Define a triangular mask for causal attention with `jax.numpy.tril` and `jax.numpy.ones`.
  def causal_attention_mask(seq_len):
      return jnp.tril(jnp.ones((seq_len, seq_len)))

  class TransformerBlock(nnx.Module):
      """ A single Transformer block."""
      def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
          self.mha = nnx.MultiHeadAttention(num_heads=num_heads,
                                            in_features=embed_dim,
                                            kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                            rngs=rngs)
          self.dropout1 = nnx.Dropout(rate=rate)
          self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6,
                                           num_features=embed_dim,
                                           scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), NamedSharding(mesh, P('model'))),
                                           bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                           rngs=rngs)
          self.linear1 = nnx.Linear(in_features=embed_dim,
                                    out_features=ff_dim,
                                    kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                    rngs=rngs)
          self.linear2 = nnx.Linear(in_features=ff_dim,
                                    out_features=embed_dim,
                                    kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                    rngs=rngs)
          self.dropout2 = nnx.Dropout(rate=rate)
          self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6,
                                           num_features=embed_dim,
                                           scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), NamedSharding(mesh, P('model'))),
                                           bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                           rngs=rngs)

      def __call__(self, inputs, training: bool = False):
          input_shape = inputs.shape
          _, seq_len, _ = input_shape
          mask = causal_attention_mask(seq_len)
          attention_output = self.mha(
              inputs_q=inputs,
              mask=mask,
              decode=False
          )
          attention_output = self.dropout1(attention_output, deterministic=not training)
          out1 = self.layer_norm1(inputs + attention_output)
          ffn_output = self.linear1(out1)
          ffn_output = nnx.relu(ffn_output)
          ffn_output = self.linear2(ffn_output)
          ffn_output = self.dropout2(ffn_output, deterministic=not training)
          return self.layer_norm2(out1 + ffn_output)

  class TokenAndPositionEmbedding(nnx.Module):
      def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
          self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
          self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

      def __call__(self, x):
          positions = jnp.arange(0, x.shape[1])[None, :]
          position_embedding = self.pos_emb(positions)
          token_embedding = self.token_emb(x)
          return token_embedding + position_embedding

  class MiniGPT(nnx.Module):
      def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int, num_transformer_blocks: int, rngs: nnx.Rngs):
          self.embedding_layer = TokenAndPositionEmbedding(
                      maxlen, vocab_size, embed_dim, rngs=rngs
                  )
          self.transformer_blocks = nnx.List([TransformerBlock(
              embed_dim, num_heads, feed_forward_dim, rngs=rngs
          ) for _ in range(num_transformer_blocks)])
          self.output_layer = nnx.Linear(in_features=embed_dim,
                                         out_features=vocab_size,
                                         kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), NamedSharding(mesh, P(None, 'model'))),
                                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), NamedSharding(mesh, P('model'))),
                                         rngs=rngs)

      def __call__(self, inputs, training: bool = False):
          x = self.embedding_layer(inputs)
          for transformer_block in self.transformer_blocks:
              x = transformer_block(x, training=training)
          outputs = self.output_layer(x)
          return outputs

      @nnx.jit
      def sample_from(self, logits):
          logits, indices = jax.lax.top_k(logits, k=top_k)
          logits = nnx.softmax(logits)
          return jax.random.choice(jax.random.PRNGKey(0), indices, p=logits)

      @nnx.jit
      def generate_step(self, padded_tokens, sample_index):
          logits = self(padded_tokens)
          next_token = self.sample_from(logits[0][sample_index])
          return next_token

      def generate_text(self, max_tokens, start_tokens):
          generated = []
          print(tokenizer.decode(start_tokens), flush=True, end='')
          for i in range(max_tokens):
              sample_index = len(start_tokens) + len(generated) - 1

              padded_tokens = jnp.array((start_tokens + generated + [0] * (maxlen - len(start_tokens) - len(generated))))[None, :]
              next_token = int(self.generate_step(padded_tokens, sample_index))
              if next_token == tokenizer.encode('<|endoftext|>', allowed_special={'<|endoftext|>'})[0]:
                break
              generated.append(next_token)
              # decode and print next_token
              print(tokenizer.decode([next_token]), flush=True, end='')
          return tokenizer.decode(start_tokens + generated)

  # Creates the miniGPT model with 2 transformer blocks.
  def create_model(rngs):
      return MiniGPT(maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, num_transformer_blocks=2, rngs=rngs)

  vocab_size = tokenizer.n_vocab
  num_transformer_blocks = 2
  maxlen = 24
  embed_dim = 32
  num_heads = 4
  feed_forward_dim = 32
  num_epochs = 1
  top_k = 10

  @dataclass
  class TextDataset:
      data: list
      maxlen: int

      def __len__(self):
          return len(self.data)

      def __getitem__(self, idx: int):
          # Use Tiktoken for tokenization
          encoding = tokenizer.encode(self.data[idx], allowed_special={'<|endoftext|>'})[:self.maxlen]  # Tokenize and truncate
          return encoding + [0] * (self.maxlen - len(encoding))  # Pad to maxlen

  def load_and_preprocess_data(file_path, batch_size, maxlen):

      with open(file_path, 'r') as f:
        text = f.read()

      stories = text.split('<|endoftext|>')
      stories = [story+'<|endoftext|>' for story in stories if story.strip()]
      df = pd.DataFrame({'text': stories})
      data = df['text'].dropna().tolist()
      dataset = TextDataset(data, maxlen)

      sampler = pygrain.IndexSampler(
          len(dataset),
          shuffle=False,
          seed=42,
          shard_options=pygrain.NoSharding(),
          num_epochs=num_epochs,
      )

      dl = pygrain.DataLoader(
          data_source=dataset,
          sampler=sampler,
          operations=[pygrain.Batch(batch_size=batch_size, drop_remainder=True)],
      )

      return dl

  text_dl = load_and_preprocess_data(file_path, batch_size, maxlen)

  # Defines the loss function using `optax.softmax_cross_entropy_with_integer_labels`.
  def loss_fn(model, batch):
      logits = model(batch[0])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
      return loss, logits

  # Define the training step with the `flax.nnx.jit` transformation decorator.
  @strategy.jit
  def train_step(model: MiniGPT, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
      grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
      (loss, logits), grads = grad_fn(model, batch)
      metrics.update(loss=loss, logits=logits, lables=batch[1])
      optimizer.update(model, grads)

  model = create_model(rngs=nnx.Rngs(0))
  nudge(model, ulps)
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  metrics = nnx.MultiMetric(
      loss=nnx.metrics.Average("loss"),
  )
  rng = jax.random.PRNGKey(0)

  start_prompt = "once upon a time"
  start_tokens = tokenizer.encode(start_prompt)[:maxlen]
  print("Initial generated text:")
  generated_text = model.generate_text(maxlen, start_tokens)
  texts = [generated_text]

  metrics_history = {
      "train_loss": [],
  }

  prep_target_batch = jax.vmap(
      lambda tokens: jnp.concatenate((tokens[1:], jnp.array([0])))
  )

  step = 0
  for epoch in range(num_epochs):
      start_time = time.time()
      for batch in strategy.experimental_distribute_dataset(text_dl):
          if len(batch) % len(jax.devices()) != 0:
              continue  # skip the remaining elements
          input_batch = jnp.array(jnp.array(batch).T)
          target_batch = prep_target_batch(input_batch)
          train_step(
              model,
              optimizer,
              metrics,
              (input_batch, target_batch),
          )

          if (step + 1) % log_every == 0:
              for metric, value in metrics.compute().items():
                  metrics_history[f"train_{metric}"].append(value)
              metrics.reset()

              elapsed_time = time.time() - start_time
              print(
                  f"\n\nStep {step + 1}, Loss: {metrics_history['train_loss'][-1]}, Elapsed Time: {elapsed_time:.2f} seconds"
              )
              start_time = time.time()

              print("Generated text:")
              generated_text = model.generate_text(maxlen, start_tokens)
              texts.append(generated_text)

          step += 1
          if step == max_steps:
              break

  # Final text generation
  print("Final generated text:")
  generated_text = model.generate_text(maxlen, start_tokens)
  texts.append(generated_text)

  return {'losses': [float(v) for v in metrics_history['train_loss']], 'texts': texts, 'steps': step,
          'weights': [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]}


if __name__ == '__main__':
  import jax
  main(jax.devices(), mesh_shape=(len(jax.devices()) // 2, 2) if len(jax.devices()) > 1 else (1, 1))
