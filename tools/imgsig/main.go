// imgsig signs and verifies container images in cosign's key-pair signature format, with the
// libraries cosign itself is built on (go-containerregistry, sigstore/sigstore): a signature is a
// "simple signing" payload naming the image's manifest digest, signed with an ECDSA key, stored as a
// layer of the image <repository>:sha256-<hex>.sig with the signature in its
// dev.cosignproject.cosign/signature annotation. cosign's full build costs several minutes cold
// (docs/security.md); this is the part the deploy role needs.
//
//	imgsig verify --key cosign.pub REF   prints cosign verify's JSON (the verified payloads); exit 1 when none verifies
//	imgsig sign --key key.pem REF        signs REF's digest, adds the signature to REF's .sig image
//	imgsig generate-key-pair PREFIX      PREFIX.key (PKCS#8 PEM, unencrypted: tests) and PREFIX.pub
//
// Not here: keyless signatures (Fulcio certificates, Rekor): the role runs the real cosign for those.
package main

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"
)

const (
	payloadType    = "cosign container image signature"
	layerMediaType = types.MediaType("application/vnd.dev.cosign.simplesigning.v1+json")
	sigAnnotation  = "dev.cosignproject.cosign/signature"
)

// payload is cosign's simple signing payload (github.com/sigstore/cosign/v2/pkg/cosign/payload).
type payload struct {
	Critical struct {
		Identity struct {
			DockerReference string `json:"docker-reference"`
		} `json:"identity"`
		Image struct {
			DockerManifestDigest string `json:"docker-manifest-digest"`
		} `json:"image"`
		Type string `json:"type"`
	} `json:"critical"`
	Optional map[string]any `json:"optional"`
}

func options() []remote.Option {
	return []remote.Option{remote.WithAuthFromKeychain(authn.DefaultKeychain)}
}

// resolve gives the digest REF names now (a tag is read once; a digest is checked to exist).
func resolve(ref name.Reference) (name.Digest, error) {
	desc, err := remote.Head(ref, options()...)
	if err != nil {
		return name.Digest{}, fmt.Errorf("cannot read %s from its registry: %w", ref, err)
	}
	return ref.Context().Digest(desc.Digest.String()), nil
}

func sigTag(d name.Digest) name.Tag {
	return d.Context().Tag(strings.Replace(d.DigestStr(), ":", "-", 1) + ".sig")
}

func verify(ref name.Reference, keyFile string) ([]payload, name.Digest, error) {
	pem, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, name.Digest{}, err
	}
	pub, err := cryptoutils.UnmarshalPEMToPublicKey(pem)
	if err != nil {
		return nil, name.Digest{}, fmt.Errorf("%s is not a PEM public key: %w", keyFile, err)
	}
	verifier, err := signature.LoadVerifier(pub, crypto.SHA256)
	if err != nil {
		return nil, name.Digest{}, err
	}
	d, err := resolve(ref)
	if err != nil {
		return nil, d, err
	}
	img, err := remote.Image(sigTag(d), options()...)
	var terr *transport.Error
	if errors.As(err, &terr) && terr.StatusCode == 404 {
		return nil, d, fmt.Errorf("no signatures found for %s (no %s)", d, sigTag(d))
	}
	if err != nil {
		return nil, d, fmt.Errorf("cannot read the signatures of %s: %w", d, err)
	}
	manifest, err := img.Manifest()
	if err != nil {
		return nil, d, err
	}
	var good []payload
	var why []string
	for _, l := range manifest.Layers {
		if l.MediaType != layerMediaType {
			continue
		}
		sig, err := base64.StdEncoding.DecodeString(l.Annotations[sigAnnotation])
		if err != nil || len(sig) == 0 {
			why = append(why, fmt.Sprintf("layer %s has no signature annotation", l.Digest))
			continue
		}
		layer, err := img.LayerByDigest(l.Digest)
		if err != nil {
			return nil, d, err
		}
		body, err := readLayer(layer)
		if err != nil {
			return nil, d, err
		}
		if err := verifier.VerifySignature(bytes.NewReader(sig), bytes.NewReader(body)); err != nil {
			why = append(why, "a signature does not verify with "+keyFile)
			continue
		}
		var p payload
		if err := json.Unmarshal(body, &p); err != nil || p.Critical.Type != payloadType {
			why = append(why, "a signed payload is not a cosign image signature")
			continue
		}
		if p.Critical.Image.DockerManifestDigest != d.DigestStr() {
			why = append(why, "a signature is of "+p.Critical.Image.DockerManifestDigest+", not "+d.DigestStr())
			continue
		}
		good = append(good, p)
	}
	if len(good) == 0 {
		return nil, d, fmt.Errorf("no matching signatures for %s: %s", d, strings.Join(why, "; "))
	}
	return good, d, nil
}

func readLayer(l v1.Layer) ([]byte, error) {
	rc, err := l.Compressed() // cosign's payload layers are stored as they are, not compressed
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

func sign(ref name.Reference, keyFile string) (name.Digest, error) {
	pem, err := os.ReadFile(keyFile)
	if err != nil {
		return name.Digest{}, err
	}
	priv, err := cryptoutils.UnmarshalPEMToPrivateKey(pem, cryptoutils.SkipPassword)
	if err != nil {
		return name.Digest{}, fmt.Errorf("%s is not an unencrypted PEM private key: %w", keyFile, err)
	}
	signer, err := signature.LoadSigner(priv, crypto.SHA256)
	if err != nil {
		return name.Digest{}, err
	}
	d, err := resolve(ref)
	if err != nil {
		return d, err
	}
	var p payload
	p.Critical.Identity.DockerReference = d.Context().Name()
	p.Critical.Image.DockerManifestDigest = d.DigestStr()
	p.Critical.Type = payloadType
	body, err := json.Marshal(p)
	if err != nil {
		return d, err
	}
	sig, err := signer.SignMessage(bytes.NewReader(body))
	if err != nil {
		return d, err
	}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	if existing, err := remote.Image(sigTag(d), options()...); err == nil {
		base = existing // keep the signatures already there
	}
	img, err := mutate.Append(base, mutate.Addendum{
		Layer:       static.NewLayer(body, layerMediaType),
		Annotations: map[string]string{sigAnnotation: base64.StdEncoding.EncodeToString(sig)},
	})
	if err != nil {
		return d, err
	}
	return d, remote.Write(sigTag(d), img, options()...)
}

func generate(prefix string) error {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	privPEM, err := cryptoutils.MarshalPrivateKeyToPEM(priv)
	if err != nil {
		return err
	}
	pubPEM, err := cryptoutils.MarshalPublicKeyToPEM(priv.Public())
	if err != nil {
		return err
	}
	if err := os.WriteFile(prefix+".key", privPEM, 0o600); err != nil {
		return err
	}
	return os.WriteFile(prefix+".pub", pubPEM, 0o644)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: imgsig verify|sign --key FILE REF; imgsig generate-key-pair PREFIX")
		os.Exit(2)
	}
	cmd := os.Args[1]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	key := fs.String("key", "", "public key (verify) or private key (sign), PEM")
	_ = fs.Parse(os.Args[2:])
	if cmd == "generate-key-pair" && fs.NArg() == 1 {
		if err := generate(fs.Arg(0)); err != nil {
			fmt.Fprintln(os.Stderr, "imgsig:", err)
			os.Exit(1)
		}
		return
	}
	if (cmd != "verify" && cmd != "sign") || fs.NArg() != 1 || *key == "" {
		fmt.Fprintln(os.Stderr, "usage: imgsig verify|sign --key FILE REF; imgsig generate-key-pair PREFIX")
		os.Exit(2)
	}
	ref, err := name.ParseReference(fs.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, "imgsig:", err)
		os.Exit(2)
	}
	if cmd == "sign" {
		d, err := sign(ref, *key)
		if err != nil {
			fmt.Fprintln(os.Stderr, "imgsig:", err)
			os.Exit(1)
		}
		fmt.Fprintln(os.Stderr, "imgsig: signed", d)
		return
	}
	good, d, err := verify(ref, *key)
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "Verification for %s --\nThe signatures were verified against the specified public key\n", d)
	out, _ := json.Marshal(good)
	fmt.Println(string(out))
}
